"""Infrastructure below the model core: crash-safe file operations and locks (fsio.py), progress
lines on stderr (progress.py). Imports no other project code."""
