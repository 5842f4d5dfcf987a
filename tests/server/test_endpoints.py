"""/health, /v1/models and /metrics."""

import httpx
from server_helpers import MAX_MODEL_LEN, MODEL, parse_prometheus

METRICS = {
    "tandem_num_requests_running": "gauge",
    "tandem_num_requests_waiting": "gauge",
    "tandem_cache_pages_used": "gauge",
    "tandem_cache_pages_total": "gauge",
    "tandem_prompt_tokens_total": "counter",
    "tandem_generation_tokens_total": "counter",
    "tandem_requests_finished_total": "counter",
    "tandem_requests_rejected_total": "counter",
    "tandem_requests_failed_total": "counter",
    "tandem_prefix_cache_queries_total": "counter",
    "tandem_prefix_cache_hits_total": "counter",
    "tandem_kv_cache_usage_perc": "gauge",
    "tandem_num_preemptions_total": "counter",
    "tandem_time_to_first_token_seconds": "histogram",
    "tandem_inter_token_latency_seconds": "histogram",
    "tandem_e2e_request_latency_seconds": "histogram",
    "tandem_step_num_requests": "histogram",
    "http_requests_total": "counter",
}


def test_health(server):
    response = httpx.get(f"{server.url}/health", timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_models_lists_the_served_model_and_no_path(client, chat_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "tandem"
    response = httpx.get(f"{client.base_url}models", timeout=30)
    raw = response.json()["data"][0]
    assert raw["max_model_len"] == MAX_MODEL_LEN and raw["root"] == MODEL
    assert str(chat_model_dir) not in response.text and chat_model_dir.name not in response.text


def test_metrics_are_prometheus_text_and_count_what_happened(server, client):
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.headers["content-type"].startswith("text/plain")
    types = {line.split()[2]: line.split()[3] for line in response.text.splitlines() if line.startswith("# TYPE")}
    assert types == METRICS
    samples = parse_prometheus(response.text)
    assert {dict(labels)["model_name"] for name, labels in samples if name != "http_requests_total"} == {MODEL}
    assert {dict(labels).get("finish_reason") for name, labels in samples
            if name == "tandem_requests_finished_total"} == {"stop", "length", "abort", "error"}

    before = server.wait_idle()
    usage = client.completions.create(model=MODEL, prompt="The page pool", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True}).usage
    after = server.wait_idle()
    assert after["tandem_prompt_tokens_total"] - before["tandem_prompt_tokens_total"] == usage.prompt_tokens
    assert after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"] == 5
    assert after["tandem_requests_finished_total:length"] - before["tandem_requests_finished_total:length"] == 1
    assert after["tandem_cache_pages_used"] == 0 and after["tandem_cache_pages_total"] > 0

    def delta(name):
        return after[name] - before[name]

    # vLLM's meanings: one first token, four gaps between the five tokens, one end-to-end latency.
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") == 4
    assert delta("tandem_e2e_request_latency_seconds_count") == 1
    assert delta("tandem_e2e_request_latency_seconds_bucket:+Inf") == 1
    assert after["tandem_kv_cache_usage_perc"] == 0.0
    assert delta("http_requests_total:POST /v1/completions 200") == 1
