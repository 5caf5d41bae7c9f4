"""GGUF (llama.cpp) files: header.py validates, reader.py reads, blocks.py dequantizes."""

from clipcli.formats.gguf.reader import GgufReader

__all__ = ["GgufReader"]
