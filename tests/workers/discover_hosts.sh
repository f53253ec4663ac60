#!/bin/sh
# Host discovery for the elastic tests (tests/test_elastic.py): horovodrun runs this about once a
# second; it prints "host:slots" lines from the file the test and its workers rewrite.
exec cat "${HVD_SLOWMO_TEST_HOSTS:?set HVD_SLOWMO_TEST_HOSTS to the hosts file}"
