"""What the tests share: real sshd hosts (:mod:`sshd`), a Slurm mini-cluster (:mod:`slurm`), rank processes
started as the agent would (:mod:`rankrunner`), site fixtures, the framework check scripts and the benches'
runner. Helpers start real processes; they simulate only hardware this machine lacks."""
