"""Byte-level checkpoint I/O that knows no format: safetensors streaming (safetensors_io.py), O_DIRECT writes
(direct_write.py), DCP metadata and reads (dcp_io.py), the reader Protocols (readers.py), convert's thread
pipeline (pipeline.py), finiteness checks (finite.py), torch.save into memory with signals held (torch_bytes.py)."""
