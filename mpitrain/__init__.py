"""mpitrain: distributed deep-learning training on NumPy and MPI.

Importing the package does not import mpi4py or start MPI; only ``mpitrain.comm.world()`` does.
"""

__version__ = "0.1.0"
