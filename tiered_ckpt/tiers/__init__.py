"""The tiers (local disk, object store), what they hold, and the store where they meet."""
