"""The torch-free core: engine config, sampling params, request state, the scheduler, KV block
bookkeeping, and the contract types the stages hand each other (scheduler output, runner output,
request output, step stats). Nothing here imports torch, so its tests run in milliseconds."""
