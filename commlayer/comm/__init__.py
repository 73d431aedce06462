"""What the API layer uses to move gradients: the communicator (compress, move the payload,
decompress: one place for the optimizer and the DDP hook) and its sparse reduction. The byte
records payloads travel as are core/wire.py's, which ops.py's sparse allreduce shares."""
