"""Task `lm`'s HTTP endpoints: router, protocol (request bodies) and serving."""
