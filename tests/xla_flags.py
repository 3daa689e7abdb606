"""The XLA flags of the test processes, set by tests/conftest.py before JAX is imported.

Compiling is most of the suite's time on CPU: each test builds programs of its
own shapes and settings. Two flags make XLA's CPU back end build them faster,
neither changing what they compute (the same HLO passes, no fast math):

* back-end optimisation level 0: LLVM optimises the generated code less, so
  it runs slower; programs that run long enough for that to matter are few here;
* `--xla_cpu_use_fusion_emitters=false`: each fusion's code comes from XLA's
  elemental IR emitter instead of its MLIR fusion emitters, which build an MLIR
  module and run a pass pipeline per fusion. The engine's programs hold
  hundreds of small fusions, so that fixed cost was most of a small model's
  compile.

Checked bit for bit: the tokens, log-probabilities and logits of sampled,
nucleus and greedy runs on the tiny model, SmolLM2 and Gemma 3 are identical
with and without the second flag. Set XLA_FLAGS yourself to run the suite with
XLA's defaults, the code users get (tests/conftest.py keeps a value it finds).
"""

BACKEND_OPTIMIZATION = "--xla_backend_optimization_level=0"
ELEMENTAL_EMITTER = "--xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process: `devices` CPU devices, compiled as the suite compiles."""
    return f"--xla_force_host_platform_device_count={devices} {BACKEND_OPTIMIZATION} " \
           f"{ELEMENTAL_EMITTER}"
