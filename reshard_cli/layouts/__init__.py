"""What the user writes, validated once into frozen objects.

yamlio (safe YAML with line numbers; one-line errors `file:line: key: ...` with did-you-mean for typos) →
models (manifests: tensor names, shapes, dtypes from HF configs, safetensors headers or YAML lists) →
layout (meshes, ranks and placement rules → a `Placement` per tensor) and topology (NVLink domains, link
figures); bundled (the data reshard ships, found by name from any directory).
"""
