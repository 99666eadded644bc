"""Pre-flight checks of the nodes a job will run on (`shoal doctor`): environment, network,
rendezvous, a real all-reduce, and the report that names what fails where."""
