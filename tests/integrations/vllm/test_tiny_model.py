"""make-tiny-model writes a model that plain vLLM (CPU) loads offline and decodes greedily, deterministically."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

# Run in a child: vLLM's CPU platform spawns, and an engine in the pytest process would outlive the test.
GENERATE = """
import json, sys

def main():
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], enforce_eager=True, block_size=32, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["the cat sat on the mat", "one two three four five", "the king of the north went home"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    chat = llm.chat([{"role": "user", "content": "hello, how are you?"}], params, use_tqdm=False)
    print("RESULT " + json.dumps({"first": [list(t) for t in first], "again": [list(t) for t in again],
                                  "chat": chat[0].outputs[0].text}))

if __name__ == "__main__":
    main()
"""

ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
}


@pytest.mark.slow
def test_tiny_model_loads_in_vllm_and_decodes_greedily(tmp_path):
    model = tmp_path / "tiny"
    made = subprocess.run(
        [sys.executable, "-m", "ascend_dualpath", "make-tiny-model", str(model)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert made.returncode == 0, made.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(model))
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    out = subprocess.run(
        [sys.executable, str(script), str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["first"] == result["again"]  # greedy decoding is deterministic
    for tokens in result["first"]:
        assert len(tokens) == 16 and len(set(tokens)) >= 4, tokens  # not one repeated token
    assert len({tuple(t) for t in result["first"]}) == 3  # different prompts, different continuations
    assert result["chat"].strip()
