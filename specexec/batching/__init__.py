"""Several requests in one streamed pass (a forest): the pass over every running request's rows
(forest_pass.py) and the seats that gather the requests' passes into it (seats.py). Imports nothing itself."""
