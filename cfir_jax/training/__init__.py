"""Training: one loop (`loop.run`) over a small task (`tasks.TextTask`: the language expert on cached images;
`tasks.FullTask`: D-BEiT-3 Full from pixels), with the contrastive loss, mesh and parameter rules, the steps, and
the data."""
