"""Writers: torch zip and safetensors, streaming storage bytes from the input, atomically, verified by re-reading."""
