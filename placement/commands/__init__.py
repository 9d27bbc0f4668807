"""One module per `placement` subcommand."""
