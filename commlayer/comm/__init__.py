"""What the API layer uses to move gradients: the communicator (compress, move the payload,
decompress: one place for the optimizer and the DDP hook), its sparse reduction and the sparse
wire format."""
