"""vLLM's own offline example, run as a user would after changing only the import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# vLLM's examples/offline_inference/basic/basic.py, verbatim but for two lines: the import
# (vllm -> kvserve) and the LLM(...) call, pointed at the default model and given the
# engine arguments vLLM scripts commonly pass.
BASIC_PY = """
from kvserve import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(model="SmolLM2-135M-Instruct", {engine_args})
    # Generate texts from the prompts.
    # The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {{prompt!r}}")
        print(f"Output:    {{generated_text!r}}")
        print("-" * 60)


if __name__ == "__main__":
    main()
"""

ENGINE_ARGS = (
    "gpu_memory_utilization=0.02, enforce_eager=True, trust_remote_code=True, "
    "tensor_parallel_size=1, dtype='auto', max_model_len=512, seed=0, swap_space=4, "
    "cpu_offload_gb=0, compilation_config={'level': 0}, disable_log_stats=True, "
    "max_logprobs=20, generation_config='auto', load_format='auto', revision=None, "
    "download_dir=None, max_num_seqs=8, enable_prefix_caching=True, tokenizer_mode='auto'"
)


def test_vllm_basic_example_runs_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "basic.py"
    script.write_text(BASIC_PY.format(engine_args=ENGINE_ARGS))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Prompt:    ") == 4
    assert "Prompt:    'The capital of France is'" in done.stdout
    # Every argument without a use here is named in the log, never dropped silently.
    for name in ("enforce_eager", "swap_space", "cpu_offload_gb", "compilation_config"):
        assert f"{name}=" in done.stderr, name
    assert "GPU-only" in done.stderr
    assert "trust_remote_code=True has no effect" in done.stderr
