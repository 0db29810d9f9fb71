"""What every test of the node shares: the node process, reaping, the fake clock, moto, free ports, scraping."""
