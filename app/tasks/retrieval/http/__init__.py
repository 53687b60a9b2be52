"""Task `retrieval`'s HTTP endpoints: router, protocol (request bodies)."""
