"""The OpenAI-compatible server behind `tandem serve`, in request order:

app (routes) -> protocol (request models -> SamplingParams) -> completions / chat -> async_engine
(the one engine thread) -> streaming (SSE, text deltas, disconnects); errors and metrics on the side.
"""
