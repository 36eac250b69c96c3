"""kvserve's OpenAI-compatible HTTP front end (FastAPI) over the async engine."""
