"""regen's simulator of the part of SGLang's HTTP API that regen uses (``regen sim``): its
settings (declared once), its batching, its text and tokens, and the HTTP app."""
