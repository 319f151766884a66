#include "common/log_context.h"

#include <utility>

namespace rdma_agent {
namespace {

thread_local LogContext current_context;

}  // namespace

const LogContext& CurrentLogContext() { return current_context; }

ScopedLogContext::ScopedLogContext(LogContext context)
    : saved_(std::exchange(current_context, std::move(context))) {}

ScopedLogContext::~ScopedLogContext() { current_context = std::move(saved_); }

}  // namespace rdma_agent
