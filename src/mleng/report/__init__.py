"""HTML reports of stored runs, with plots drawn as inline SVG (no CDN, no plotting library)."""
