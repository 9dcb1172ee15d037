"""The host and its runtime: CPU capabilities, cores for engines, OpenMP settings, freed
memory kept, a Ray on this machine alone (and what it listens on), and torch.distributed
rendezvous stores on one address."""
