"""KV transport: a request's KV blocks from a prefill worker's cache into the blocks its
decode worker reserved. The interface and its fault contract: interface.py.

    interface.py   KVTransport, KVEndpoint, KVTransferError: what every transport does
    torch_dist.py  TorchDistTransport: a torch.distributed group per (prefill, decode) pair
                   (gloo on CPU, NCCL on CUDA); between workers on one host, CPU payloads
                   through shared-memory files (shm_slots.py) instead of the sockets
    packing.py     a transfer's payload: blocks of every layer packed into one tensor
    wire.py        the header before each part
    faults.py      transfers a sender fails on purpose (tests)

builder.py's `open_transport` builds a worker rank's transport from its TransportConfig:
the one place a transport is chosen. The package imports nothing itself, and interface.py
no torch: the gateway carries endpoints without loading torch.
"""
