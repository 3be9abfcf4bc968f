// Catch2's runner for the host suite.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
