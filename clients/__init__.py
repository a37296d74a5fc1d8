"""Everything that runs on a device: the ClientApp and the clients.

The client of a run is the class its algorithm's row names (``fedpers.algorithms``),
imported on first use, so a numpy-only run never loads torch. ``strategies`` does the
same on the server side, and neither package imports the other.
"""
