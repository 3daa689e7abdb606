"""The engines a decode.py cell runs, one module each, all in decode.py's row schema.

`jaxsample_engines.py`: jaxsample's shared-prefix engine and the naive
engine (the subject); `hf.py`: Hugging Face transformers
`generate(num_return_sequences=N)`; `llamacpp.py`: `llama-batched-bench
-pps -kvu`. Each has a `load`/`run_cell` pair (llama.cpp: `cells`, an
external process) and imports its framework only when called, so a missing
torch or llama.cpp costs only its own rows, each saying why in one line.
"""
