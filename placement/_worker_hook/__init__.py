"""The directory placerun puts first on its Python workers' PYTHONPATH: its `sitecustomize` runs
stage 1 in each worker before the user's program (see placement.launcher). Nothing to import here."""
