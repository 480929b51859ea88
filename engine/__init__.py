"""Building and driving one vLLM engine: model preparation, engine arguments per role (KV
producer, consumer or both, with Baton's connector and KV-event wiring), and the thread that
drives an in-process engine from asyncio. Nothing here knows about Ray actors or placement."""
