#include "daemon/metrics/process_metrics.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

std::map<std::string, double> Values(const std::string& proc_self) {
  std::map<std::string, double> values;
  for (const prometheus::MetricFamily& family :
       CollectProcessMetrics(proc_self)) {
    EXPECT_EQ(family.metric.size(), 1u) << family.name;
    const prometheus::ClientMetric& metric = family.metric.front();
    values[family.name] = family.type == prometheus::MetricType::Counter
                              ? metric.counter.value
                              : metric.gauge.value;
  }
  return values;
}

TEST(ProcessMetricsTest, ReadsStatAndFdsOfTheGivenProcessDirectory) {
  char dir[] = "/tmp/procXXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string root = dir;
  // A command name with spaces and a parenthesis, as proc(5) allows.
  std::ofstream(root + "/stat")
      << "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 "
      << 3 * ::sysconf(_SC_CLK_TCK) << " " << 2 * ::sysconf(_SC_CLK_TCK)
      << " 0 0 20 0 7 0 " << 5 * ::sysconf(_SC_CLK_TCK) << " 123456789 " << 1000
      << " 18446744073709551615\n";
  ASSERT_EQ(::mkdir((root + "/fd").c_str(), 0755), 0);
  for (const char* fd : {"/fd/0", "/fd/1", "/fd/2"}) {
    std::ofstream(root + fd) << "";
  }
  const std::map<std::string, double> values = Values(root);
  EXPECT_EQ(values.at("process_cpu_seconds_total"), 5);
  EXPECT_EQ(values.at("process_threads"), 7);
  EXPECT_EQ(values.at("process_virtual_memory_bytes"), 123456789);
  EXPECT_EQ(values.at("process_resident_memory_bytes"),
            1000.0 * ::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(values.at("process_open_fds"), 3);
  EXPECT_GT(values.at("process_start_time_seconds"), 1e9);
  EXPECT_GT(values.at("process_max_fds"), 0);
  std::system(("rm -rf " + root).c_str());
}

TEST(ProcessMetricsTest, ThisProcessHasPlausibleValues) {
  const std::map<std::string, double> values = Values("/proc/self");
  EXPECT_GT(values.at("process_resident_memory_bytes"), 0);
  EXPECT_GE(values.at("process_threads"), 1);
  // stdin, stdout, stderr at least; the directory's own fd is not counted.
  EXPECT_GE(values.at("process_open_fds"), 3);
  EXPECT_LE(values.at("process_open_fds"), values.at("process_max_fds"));
}

}  // namespace
}  // namespace rdma_agent
