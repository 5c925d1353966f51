"""Launching: what runs around the workers, in the parent process and at the edges of each worker's life.

launcher.main (`distrib launch`) and launcher.launch_trainer (`distrib train --nproc-per-node`): torch's elastic
agent with better defaults, SLURM and SkyPilot detection, checks before any worker starts, and the only writer of
the launch environment. Its parts: arguments (the command line, its defaults and checks), environment (what the
workers inherit), agent (torch's agent run, its failures as lines), exits (stop signals, exit codes), replica_groups
(the group flags) and group_launches (G groups on one node as one run). clusters: which cluster environment a node
runs in (PET_*, Kubeflow, SLURM, SkyPilot), one function each. reporting: what it reports of its workers' ends (one
line per way of failing). lifeline: the small process that ties each worker to its launcher. preempt: stop signals.
rundir: the run's folders and their locks. doctor: `distrib doctor`. This __init__ imports nothing:
`python -m distrib.launch.lifeline` runs in every worker's parent and must stay small (no torch, no launcher)."""
