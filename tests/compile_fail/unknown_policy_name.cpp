// expect: no preset policy has this name
#include <mpx/mpx.hpp>
int main() {
  auto p = mpx::policy_by_name(BOOST_HANA_STRING("mixed_float8"));
  (void)p;
}
