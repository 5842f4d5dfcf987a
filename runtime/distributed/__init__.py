"""Tensor parallelism over torch.distributed: one model across several processes, GPUs or machines.

`state` is this process's rank and the collectives; `sharding` cuts a built model for one rank;
`group` starts (or, under torchrun, joins) the process group and its worker processes; `worker`
is what the other ranks run; `runner` is rank 0's face of the group to the engine; `env` reads
torchrun's environment without importing torch.
"""
