"""The decoding engine: Llama-family models, paged attention backends, scheduler, OpenAI API.

Not built yet in this version (see README, "Status"); `kvstore serve` will run it.
"""
