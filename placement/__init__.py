"""placement: put every hot thread of every rank on the right core, watch what each step costs, tune."""

__version__ = "0.1.0"


def attach(*args, **kwargs):
    """Bind this rank's threads by role, start the monitor, return a handle (see placement.attach_api)."""
    # Imported on first call: placerun and every worker's sitecustomize import this package, and
    # attach_api would add ~25 ms to each (python -X importtime -c "import placement.config").
    from placement.attach_api import attach as _attach

    return _attach(*args, **kwargs)


__all__ = ["attach", "__version__"]
