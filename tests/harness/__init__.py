"""What the tests share: the node process, reaping, the fake clock, moto, ports, scraping."""
