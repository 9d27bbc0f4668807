"""`placement selftest`: what a user runs on one GPU node before trusting placement. It
launches a short real job under placerun (job.py), then judges what each rank saw against
its plan (checks.py); runner.py ties them together."""
