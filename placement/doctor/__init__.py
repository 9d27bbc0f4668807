"""`placement doctor`: host checks with severity, evidence and the fix.

facts.py reads what the checks need beyond the Topology (one plain function per fact, through a
root dir, bounded reads); checks.py holds the checks (pure functions of Facts); command.py is the
subcommand (`gather`, the text and JSON reports).
"""
