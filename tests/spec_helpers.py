"""Shared by the speculative decoding tests (n-gram, draft model, MTP): stepping an engine while watching what
each step holds, and the counters' check that drafts were both accepted and rejected."""


def run_watching_steps(llm, prompts, params):
    """Generate step by step; return the outputs and whether a step mixed a verify, a plain decode and a
    prefill chunk. Proposing ahead of the engine shows what its step will hold: every method's proposals are
    a pure function of the tokens (an MTP head's of its cache, whose entries for the drafts are dropped again)."""
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    done, mixed = {}, False
    while engine.has_unfinished():
        running = engine.scheduler.running
        engine.speculator.propose(running)
        drafted = any(s.spec_token_ids for s in running)
        plain = any(not s.spec_token_ids and s.num_computed_tokens >= len(s.prompt_token_ids) for s in running)
        prefill = any(s.num_computed_tokens < len(s.prompt_token_ids) for s in running) or engine.scheduler.waiting
        mixed |= drafted and plain and bool(prefill)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids], mixed


def assert_drafts_accepted_and_rejected(llm):
    counters = llm.engine.speculator.counters
    assert counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
