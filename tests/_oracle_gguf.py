"""An F32 copy of a GGUF file: every quantized tensor dequantized, metadata unchanged (for llama.cpp runs
whose only difference from minillama is llama.cpp's own arithmetic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def dequantized_copy(src: str | Path, dest: str | Path) -> Path:
    """Write `dest`: the tensors of `src` as F32 (same names and shapes), its metadata as it is."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dest), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key == "general.file_type":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type != Q.F32 else np.asarray(t.data)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)
