"""LoRA adapters served (`tandem serve --enable-lora --lora-modules NAME=PATH`), through the official openai client:
an adapter's name as `model` gives the offline engine's tokens for that adapter, concurrently with requests naming
other adapters and the base model; adapters load and unload at run time behind the API key; unknown names are 404
and bad adapters 400, naming the adapter; a bad --lora-modules exits 2 before serving."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from lora_helpers import linear_names, make_adapter, targets
from server_helpers import MODEL, ROOT, SERVER_ARGS, serve

from runtime import LLM, LoRARequest, SamplingParams

KEY = "lora-key"
PROMPT = "The page pool holds"
TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """Three adapters of the tiny Bamba the server serves: {name: path}."""
    _, hf = tiny_checkpoint("bamba")
    paths = {}
    for i in range(3):
        path = tmp_path_factory.mktemp(f"served-adapter{i}")
        make_adapter(hf, path, seed=20 + i, r=4, lora_alpha=8, target_modules=targets(linear_names(hf)))
        paths[f"adapter{i}"] = str(path)
    return paths


@pytest.fixture(scope="module")
def expected(chat_model_dir, adapters):
    """The offline engine's greedy tokens for the base model and each adapter: {name: text}."""
    llm = LLM(chat_model_dir, dtype="float32", enable_lora=True, max_loras=3)
    names = [MODEL, *adapters]
    loras = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    outputs = llm.generate([PROMPT] * len(names), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    texts = {name: o.outputs[0].text for name, o in zip(names, outputs)}
    assert len(set(texts.values())) == len(texts), "each adapter must change the text"
    return texts


@pytest.fixture(scope="module")
def server(chat_model_dir, adapters, tmp_path_factory):
    first = [f"{name}={path}" for name, path in list(adapters.items())[:2]]
    args = (*SERVER_ARGS, "--enable-lora", "--max-loras", "2", "--api-key", KEY, "--lora-modules", *first)
    with serve(chat_model_dir, tmp_path_factory.mktemp("logs") / "lora.log", *args) as running:
        yield running


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.model == model  # the adapter's name, as vLLM answers
    return response.choices[0].text


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_requests_naming_different_adapters_concurrently_get_their_own_tokens(server, expected):
    client = client_of(server)
    names = [MODEL, "adapter0", "adapter1"] * 4
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda name: complete(client, name), names))
    assert texts == [expected[name] for name in names]
    listed = {card.id for card in client.models.list().data}
    assert listed == {MODEL, "adapter0", "adapter1"}


def test_adapters_load_and_unload_at_run_time(server, adapters, expected):
    client = client_of(server)
    with pytest.raises(openai.NotFoundError, match="the model 'adapter2' does not exist"):
        complete(client, "adapter2")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "adapter2", "lora_path": adapters["adapter2"]}
                ).status_code == 200
    assert complete(client, "adapter2") == expected["adapter2"]
    assert "adapter2" in {card.id for card in client.models.list().data}
    # Three adapters through two slots: each request still gets its own.
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda n: complete(client, n), ["adapter0", "adapter1", "adapter2"])) == [
            expected["adapter0"], expected["adapter1"], expected["adapter2"]]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "adapter2"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'adapter2' does not exist"):
        complete(client, "adapter2")
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "adapter2"})
    assert response.status_code == 404 and "'adapter2' is not loaded" in response.text


def test_bad_adapters_are_refused_by_name_and_the_server_goes_on(server, expected, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)})
    assert response.status_code == 400 and "LoRA adapter 'broken'" in response.text
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "adapter0", "lora_path": str(tmp_path)})
    assert response.status_code == 400 and "'adapter0' is already loaded" in response.text
    unauthorized = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
    assert unauthorized.status_code == 401
    client = client_of(server)
    assert "broken" not in {card.id for card in client.models.list().data}
    assert complete(client, "adapter0") == expected["adapter0"]


@pytest.mark.parametrize("args, message", [
    (("--lora-modules", "adapter0"), "write each adapter as NAME=PATH"),
    (("--enable-lora", "--lora-modules", "broken=/nowhere"), "LoRA adapter 'broken' (/nowhere): no such directory"),
    (("--lora-modules", "a=/nowhere"), "--lora-modules needs --enable-lora"),
])
def test_a_bad_lora_module_exits_2_naming_it(chat_model_dir, args, message):
    command = [sys.executable, "-m", "runtime", "serve", str(chat_model_dir), "--port", "0", *SERVER_ARGS, *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
