"""The model side of jaxsample, installed as `jaxsample.models`: one subpackage per concern.

    families/       the decoders as pure JAX functions (Llama, Gemma 2 and 3,
                    the MoE FFN), what they share (`common`, `flash`) and
                    `families.module_for(cfg)`, the one interface
    checkpoints/    reading a checkpoint: the formats (GGUF, Hugging Face
                    directories), each family's config and tensor mapping,
                    the model-name registry, the tokenizer and chat template
    quantization/   int8 weights (`quant`) and their calibrated outlier
                    channels (`outliers`)
    cpu_kernels/    the int8 decode's C++ CPU kernels (XLA FFI custom calls)
                    and the Python that builds, checks and calls them

Nothing here imports the engine's layers (`jaxsample.lm`, the engine, the
caches): only the base modules below them (`jaxsample.errors`,
`jaxsample.cache_paths`, `jaxsample.file_hashes`, ...; tests/project/test_layout.py
holds the rule). A `LanguageModel` is built on top, by `jaxsample.loading`
(and `jaxsample.tiny`, the tests' random model).
"""
