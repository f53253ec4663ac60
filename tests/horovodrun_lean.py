"""``horovodrun`` for the tests' launches, without its controller build check.

Before it starts the workers, horovodrun asks whether Horovod was built with Gloo (``--gloo``) or
MPI (``--mpi``) by importing ``horovod.torch``, and so torch, in a forked child: ~3 CPU-seconds
per launch, a quarter of a small launch's cost on a loaded 2-core machine. The workers import
``horovod.torch`` anyway, and their ``hvd.init()`` fails if the controller was not built, so the
check adds nothing to a test. Everything else (host parsing, interfaces, rendezvous, the workers'
environment, mpirun's command line) is horovodrun's own code.

Usage: python tests/horovodrun_lean.py HOROVODRUN_ARGS...
"""

import sys

from horovod.runner import launch

if __name__ == "__main__":
    launch.gloo_built = launch.mpi_built = lambda verbose=False: True
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
