"""KV codecs beyond raw and zstd (see :mod:`kvmesh.core.serde` for the ``Codec`` seam):
``safetensors`` (lossless, LMCache's ``safetensor``) and ``cachegen`` (lossy, opt-in)."""
