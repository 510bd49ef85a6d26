"""Images in: an mmproj file's preprocessing and vision encoder (`image`, `encoder`)."""
