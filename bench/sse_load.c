// SPDX-License-Identifier: Apache-2.0
/*
 * The traffic vLLM's OpenAI server produces for streamed completions, without vLLM: every decode
 * step emits one token for every running sequence, and the API server writes one small SSE frame
 * ("data: {...}\n\n", TCP_NODELAY) per token to each stream's socket.
 *
 *   sse_load serve  PORT STREAMS FRAME_BYTES SECONDS STEP_US   (STEP_US 0: steps back to back)
 *   sse_load client PORT STREAMS
 *
 * The server accepts STREAMS connections, then for SECONDS runs decode steps: one frame to every
 * stream per step, a step every STEP_US microseconds. Each frame carries its send time
 * (CLOCK_MONOTONIC, same host). The client reads all streams with epoll until every one closes
 * and prints one line: frames, frames/s, inter-token latency (gap between consecutive frames of one
 * stream) p50/p99 and delivery latency (receive time - send time) p50/p99, in microseconds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_STREAMS 4096
#define HIST_US 1000000 /* 1 us buckets up to 1 s; longer lands in the last bucket */

static uint64_t now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static void die(const char *what)
{
	perror(what);
	exit(2);
}

/* "data: {\"seq\":%010u,\"ts\":%020llu,\"choices\":[{\"text\":\"tok\"}],\"pad\":\"xx..\"}\n\n" */
static const char HEAD[] = "data: {\"seq\":";
#define SEQ_OFF (sizeof(HEAD) - 1)
#define TS_OFF (SEQ_OFF + 10 + 7) /* ,"ts": */

static int make_frame(char *buf, int size, unsigned seq, uint64_t ts)
{
	int n = snprintf(buf, size + 1, "data: {\"seq\":%010u,\"ts\":%020llu,\"choices\":[{\"text\":\"tok\"}],\"pad\":\"",
			 seq, (unsigned long long)ts);
	if (n + 4 > size)
		return -1;
	memset(buf + n, 'x', size - n - 4);
	memcpy(buf + size - 4, "\"}\n\n", 4);
	return size;
}

static void write_all(int fd, const char *p, size_t n)
{
	while (n) {
		ssize_t w = write(fd, p, n);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			die("write");
		}
		p += w;
		n -= w;
	}
}

static int serve(int port, int streams, int frame, double seconds, long step_us)
{
	int one = 1, lfd = socket(AF_INET, SOCK_STREAM, 0), fds[MAX_STREAMS];
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	char buf[4096];
	unsigned seq = 0;
	long overruns = 0, steps = 0;

	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(lfd, (void *)&a, sizeof(a)) || listen(lfd, streams))
		die("bind/listen");
	printf("ready\n");
	fflush(stdout);
	for (int i = 0; i < streams; i++) {
		fds[i] = accept(lfd, NULL, NULL);
		if (fds[i] < 0)
			die("accept");
		setsockopt(fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* as uvicorn does */
	}
	uint64_t start = now_ns(), end = start + (uint64_t)(seconds * 1e9), next = start;
	while (now_ns() < end) {
		for (int i = 0; i < streams; i++) {
			if (make_frame(buf, frame, seq++, now_ns()) < 0)
				die("frame too small");
			write_all(fds[i], buf, frame);
		}
		steps++;
		if (step_us) {
			next += step_us * 1000ull;
			uint64_t t = now_ns();
			if (t >= next) {
				overruns++;
				next = t;
			} else {
				struct timespec ts = { .tv_sec = next / 1000000000ull, .tv_nsec = next % 1000000000ull };
				clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
			}
		}
	}
	for (int i = 0; i < streams; i++)
		close(fds[i]);
	fprintf(stderr, "steps %ld overruns %ld\n", steps, overruns);
	return 0;
}

static uint32_t itl_hist[HIST_US], lat_hist[HIST_US];

static void hist_add(uint32_t *h, uint64_t ns)
{
	uint64_t us = ns / 1000;

	h[us < HIST_US ? us : HIST_US - 1]++;
}

static double hist_pct(const uint32_t *h, double pct)
{
	uint64_t total = 0, seen = 0;

	for (int i = 0; i < HIST_US; i++)
		total += h[i];
	for (int i = 0; i < HIST_US; i++) {
		seen += h[i];
		if (total && seen * 100.0 >= pct * total)
			return i + 0.5;
	}
	return -1;
}

struct stream {
	int fd, have, open;
	uint64_t last;
	char buf[8192];
};

static int client(int port, int streams)
{
	static struct stream st[MAX_STREAMS];
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct epoll_event ev[256];
	int ep = epoll_create1(0), open = streams, frame = 0;
	uint64_t frames = 0, first = 0, last = 0, bad = 0;

	for (int i = 0; i < streams; i++) {
		st[i].fd = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(st[i].fd, (void *)&a, sizeof(a)))
			die("connect");
		st[i].open = 1;
		struct epoll_event e = { .events = EPOLLIN, .data.u32 = i };
		epoll_ctl(ep, EPOLL_CTL_ADD, st[i].fd, &e);
	}
	while (open) {
		int n = epoll_wait(ep, ev, 256, 30000);

		if (n <= 0)
			die("epoll_wait (no frames for 30 s)");
		for (int k = 0; k < n; k++) {
			struct stream *s = &st[ev[k].data.u32];
			ssize_t r = read(s->fd, s->buf + s->have, sizeof(s->buf) - s->have);
			uint64_t t = now_ns();

			if (r <= 0) {
				if (r < 0 && errno == EINTR)
					continue;
				epoll_ctl(ep, EPOLL_CTL_DEL, s->fd, NULL);
				close(s->fd);
				s->open = 0;
				open--;
				continue;
			}
			s->have += r;
			char *p = s->buf, *end = s->buf + s->have, *nl;
			while ((nl = memmem(p, end - p, "\n\n", 2))) {
				int len = nl + 2 - p;

				if (!frame)
					frame = len;
				if (len != frame || memcmp(p, HEAD, SEQ_OFF)) {
					bad++;
				} else {
					uint64_t ts = strtoull(p + TS_OFF, NULL, 10);

					hist_add(lat_hist, t > ts ? t - ts : 0);
					if (s->last)
						hist_add(itl_hist, t - s->last);
					s->last = t;
					frames++;
					if (!first)
						first = t;
					last = t;
				}
				p = nl + 2;
			}
			s->have = end - p;
			memmove(s->buf, p, s->have);
		}
	}
	double secs = last > first ? (last - first) / 1e9 : 1;
	printf("frames %llu bad %llu msgs_per_s %.0f itl_p50_us %.1f itl_p99_us %.1f lat_p50_us %.1f lat_p99_us %.1f\n",
	       (unsigned long long)frames, (unsigned long long)bad, frames / secs, hist_pct(itl_hist, 50),
	       hist_pct(itl_hist, 99), hist_pct(lat_hist, 50), hist_pct(lat_hist, 99));
	return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc >= 4 && (atoi(argv[3]) < 1 || atoi(argv[3]) > MAX_STREAMS)) {
		fprintf(stderr, "STREAMS must be 1..%d\n", MAX_STREAMS);
		return 2;
	}
	if (argc == 7 && !strcmp(argv[1], "serve"))
		return serve(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atof(argv[5]), atol(argv[6]));
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(atoi(argv[2]), atoi(argv[3]));
	fprintf(stderr, "usage: %s serve PORT STREAMS FRAME_BYTES SECONDS STEP_US | client PORT STREAMS\n", argv[0]);
	return 2;
}
