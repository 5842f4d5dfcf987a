"""`tandem serve --speculative-config ...`: streamed completions equal the offline run without speculation,
and /metrics carries vLLM's speculative counters (the official openai client, a real server)."""

import json

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, SERVER_ARGS, parse_prometheus, serve

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPTS = [[9, 40, 41, 200, 7] * 3, [41, 9, 9, 40] * 3]
CHOICES = [9, 40, 41]


@pytest.fixture(scope="module")
def spec_server(chat_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with serve(chat_model_dir, log, *SERVER_ARGS, "--speculative-config", json.dumps(SPEC)) as running:
        yield running


def test_streamed_completions_equal_the_run_without_speculation(spec_server, chat_model_dir):
    from runtime import LLM, SamplingParams

    offline = LLM(chat_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=CHOICES)
    reference = offline.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    client = spec_server.client()
    for prompt, want in zip(PROMPTS, reference):
        stream = client.completions.create(model="tiny-bamba", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "allowed_token_ids": CHOICES})
        chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert "".join(chunks) == want.outputs[0].text
        assert len([c for c in chunks if c]) > 1  # streamed, not one block

    samples = parse_prometheus(httpx.get(f"{spec_server.url}/metrics", timeout=30).text)
    value = {name: v for (name, labels), v in samples.items() if ("position", "0") not in labels}
    drafts, accepted = value["tandem_spec_decode_num_draft_tokens_total"], value[
        "tandem_spec_decode_num_accepted_tokens_total"]
    assert value["tandem_spec_decode_num_drafts_total"] > 0
    assert 0 < accepted < drafts
    per_pos = [v for (name, labels), v in samples.items() if name.endswith("accepted_tokens_per_pos_total")]
    assert sum(per_pos) == accepted
