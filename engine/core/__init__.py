"""The torch-free core: engine config, sampling params and the request checks, request state, the
scheduler, KV block bookkeeping (the block pool and prefix trie, KV cache groups by attention window,
per-group block tables; KV cache events and their external block hashes), and the contract types the stages hand each other (scheduler output, runner
output, request output, step stats, pending adds/aborts, engine snapshots, request errors, the
EngineCore and EngineClient protocols, score results). Nothing here imports torch, so its tests run in
milliseconds."""
