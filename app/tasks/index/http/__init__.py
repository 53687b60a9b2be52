"""Task `index`'s HTTP endpoints: router, protocol (request bodies) and the search page."""
