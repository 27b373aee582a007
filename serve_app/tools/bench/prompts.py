"""The benchmark's prompt sets.

``copy`` asks the model to repeat, rewrite or lightly edit a given passage of prose or
code: most of the output already sits in the prompt, which is where lookup drafting pays.
``chat`` asks open questions: the output is new text, where drafting mostly misses.
Both sets interleave their kinds, so the first few prompts (all a short run uses) are
already a mix.
"""

from __future__ import annotations

SYSTEM_PROMPT = "You are a helpful assistant."

_COPY: list[tuple[str, str]] = [
    ("Repeat the following text exactly, word for word.",
     "The library opens at nine in the morning on weekdays and at ten on Saturdays. It is "
     "closed on Sundays and public holidays. Members may borrow up to eight books at a time "
     "for three weeks, and a loan can be renewed twice online or at the front desk, as long "
     "as nobody else has reserved the book. Late returns cost twenty cents a day per item, "
     "up to a maximum of five dollars. Children's books and audiobooks carry no late fees."),
    ("Rename the function `calc` to `compute_total` everywhere in this code. Change nothing else.",
     "def calc(items, tax_rate):\n"
     "    subtotal = 0\n"
     "    for item in items:\n"
     "        subtotal += item.price * item.quantity\n"
     "    tax = subtotal * tax_rate\n"
     "    return subtotal + tax\n\n\n"
     "def print_receipt(items, tax_rate):\n"
     "    for item in items:\n"
     "        print(f\"{item.name:20} {item.quantity:3} x {item.price:8.2f}\")\n"
     "    print(f\"{'Total':20} {calc(items, tax_rate):18.2f}\")\n"),
    ("Fix the spelling mistakes in this paragraph and keep everything else the same.",
     "Last sumer our team moved the hole billing system to a new data center. The migration "
     "took three weekends and went mostly acording to plan. On the first weekend we copied "
     "the archived invoices, wich were read-only and easy to check. On the second we moved "
     "the customer database and ran both systems side by side for a week. On the third we "
     "switched the trafic over and turned off the old servers. Only one problem reached "
     "customers: a batch of reminder emails went out twise."),
    ("Copy this JSON back to me unchanged.",
     '{\n  "name": "weather-station-07",\n  "location": {"lat": 47.3769, "lon": 8.5417, '
     '"elevation_m": 408},\n  "sensors": [\n    {"id": "t1", "kind": "temperature", "unit": "C", '
     '"interval_s": 60},\n    {"id": "h1", "kind": "humidity", "unit": "%", "interval_s": 60},\n'
     '    {"id": "p1", "kind": "pressure", "unit": "hPa", "interval_s": 300},\n'
     '    {"id": "w1", "kind": "wind_speed", "unit": "m/s", "interval_s": 10}\n  ],\n'
     '  "owner": "city-environment-office",\n  "active": true\n}'),
    ("Rewrite this paragraph in the past tense.",
     "Every morning Maria walks to the bakery at the end of her street. She buys two rolls "
     "and a newspaper, and she chats with the baker about the weather. Then she sits on the "
     "bench by the fountain and reads the headlines while the pigeons wait for crumbs. At "
     "half past eight she folds the paper, brushes the crumbs off her coat and takes the "
     "tram to the hospital, where she works as a nurse on the children's ward."),
    ("Add type hints to this Python function. Keep the body exactly as it is.",
     "def merge_intervals(intervals):\n"
     "    if not intervals:\n"
     "        return []\n"
     "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
     "    merged = [list(intervals[0])]\n"
     "    for start, end in intervals[1:]:\n"
     "        last = merged[-1]\n"
     "        if start <= last[1]:\n"
     "            last[1] = max(last[1], end)\n"
     "        else:\n"
     "            merged.append([start, end])\n"
     "    return [tuple(pair) for pair in merged]\n"),
    ("Replace every occurrence of \"colour\" with \"color\" in this text and repeat it.",
     "Choosing a colour scheme for a website starts with one main colour, usually taken from "
     "the brand's logo. Designers then pick a second colour for buttons and links, and a "
     "neutral background colour that keeps text easy to read. A good rule is to use the main "
     "colour for about sixty percent of the page, the second colour for thirty percent, and "
     "an accent colour for the remaining ten. Always check that the text colour has enough "
     "contrast against its background."),
    ("Convert this SQL query to use uppercase keywords. Do not change anything else.",
     "select c.customer_id,\n       c.name,\n       count(o.order_id) as order_count,\n"
     "       sum(o.total_amount) as lifetime_value\nfrom customers c\n"
     "left join orders o on o.customer_id = c.customer_id\n"
     "where c.created_at >= '2023-01-01'\n  and c.country in ('DE', 'AT', 'CH')\n"
     "group by c.customer_id, c.name\nhaving count(o.order_id) > 2\n"
     "order by lifetime_value desc\nlimit 50;"),
    ("Repeat this poem exactly.",
     "The kettle sings before the dawn,\nthe windows hold the frost,\nthe cat is curled "
     "upon the lawn\nof blankets we have tossed.\n\nThe bread is rising in its bowl,\nthe "
     "radio hums low,\nand somewhere down the long road\na truck goes through the snow.\n\n"
     "I pour the tea and warm my hands\nand watch the sky turn grey,\nand think of all the "
     "far-off lands\nthat wake up the same way."),
    ("Change the variable name `tmp` to `buffer` in this C code and show the whole code.",
     "#include <stdio.h>\n#include <string.h>\n\n"
     "void reverse(char *s) {\n    size_t n = strlen(s);\n    for (size_t i = 0; i < n / 2; i++) {\n"
     "        char tmp = s[i];\n        s[i] = s[n - 1 - i];\n        s[n - 1 - i] = tmp;\n    }\n}\n\n"
     "int main(void) {\n    char tmp[64];\n    while (fgets(tmp, sizeof tmp, stdin)) {\n"
     "        tmp[strcspn(tmp, \"\\n\")] = '\\0';\n        reverse(tmp);\n        puts(tmp);\n    }\n"
     "    return 0;\n}\n"),
    ("Turn this paragraph into a bulleted list, one sentence per bullet, keeping the wording.",
     "Preheat the oven to 180 degrees. Grease a round cake tin and line it with baking paper. "
     "Beat the butter and sugar until pale and fluffy. Add the eggs one at a time, beating "
     "well after each. Fold in the flour and the baking powder. Stir in the lemon zest and the "
     "milk. Pour the batter into the tin and smooth the top. Bake for forty minutes, until a "
     "skewer comes out clean. Let the cake cool for ten minutes before turning it out."),
    ("Repeat this YAML file exactly as given.",
     "version: \"3.9\"\nservices:\n  web:\n    image: nginx:1.25\n    ports:\n      - \"8080:80\"\n"
     "    volumes:\n      - ./site:/usr/share/nginx/html:ro\n    depends_on:\n      - api\n"
     "  api:\n    build: ./api\n    environment:\n      DATABASE_URL: postgres://app:secret@db:5432/app\n"
     "      LOG_LEVEL: info\n    depends_on:\n      - db\n  db:\n    image: postgres:16\n"
     "    environment:\n      POSTGRES_USER: app\n      POSTGRES_PASSWORD: secret\n"
     "    volumes:\n      - db-data:/var/lib/postgresql/data\nvolumes:\n  db-data: {}\n"),
    ("Rewrite this email so it is more polite, changing as few words as possible.",
     "Hi Tom,\n\nThe report you sent yesterday is missing the sales figures for March. I need "
     "them by Friday, because the board meeting is on Monday and I have to prepare the slides "
     "over the weekend. Also, the chart on page four uses the wrong colours for the regions. "
     "Fix it and send me the new version. Next time check the numbers before you send "
     "anything.\n\nAnna"),
    ("Add a docstring to this JavaScript function and repeat the code unchanged otherwise.",
     "function debounce(fn, waitMs) {\n  let timer = null;\n  return function (...args) {\n"
     "    if (timer !== null) {\n      clearTimeout(timer);\n    }\n"
     "    timer = setTimeout(() => {\n      timer = null;\n      fn.apply(this, args);\n"
     "    }, waitMs);\n  };\n}\n\n"
     "const onResize = debounce(() => {\n  console.log(window.innerWidth, window.innerHeight);\n"
     "}, 200);\nwindow.addEventListener(\"resize\", onResize);\n"),
    ("Change all prices in this text from dollars to euros, using the same numbers.",
     "Our basic plan costs $9 a month and includes 10 GB of storage. The standard plan costs "
     "$19 a month, includes 100 GB of storage and adds shared folders. The premium plan costs "
     "$49 a month, includes 1 TB of storage, shared folders and priority support. Extra "
     "storage is $2 per 10 GB on every plan. If you pay for a year in advance, the basic plan "
     "is $90, the standard plan $190 and the premium plan $490."),
    ("Repeat this shell script exactly.",
     "#!/usr/bin/env bash\nset -euo pipefail\n\nBACKUP_DIR=/var/backups/db\n"
     "STAMP=$(date +%Y-%m-%d_%H%M)\nKEEP_DAYS=14\n\nmkdir -p \"$BACKUP_DIR\"\n"
     "pg_dump --format=custom --file=\"$BACKUP_DIR/app_$STAMP.dump\" app\n"
     "gzip \"$BACKUP_DIR/app_$STAMP.dump\"\n"
     "find \"$BACKUP_DIR\" -name 'app_*.dump.gz' -mtime +\"$KEEP_DAYS\" -delete\n"
     "echo \"backup written to $BACKUP_DIR/app_$STAMP.dump.gz\"\n"),
    ("Rewrite this text replacing \"we\" with \"the company\", adjusting verbs where needed.",
     "We were founded in 2009 in a small garage in Leeds. We started by repairing bicycles for "
     "our neighbours, and we soon began building our own frames. Today we employ forty people "
     "and we ship bicycles to twelve countries. We still repair every bike we have ever sold, "
     "free of charge for the first five years. We believe a good bicycle should last a "
     "lifetime, and we design every part so that it can be replaced."),
    ("Convert this Python class to use a dataclass, keeping the field names and the method.",
     "class Point:\n    def __init__(self, x, y, label=None):\n        self.x = x\n"
     "        self.y = y\n        self.label = label\n\n"
     "    def __repr__(self):\n        return f\"Point(x={self.x}, y={self.y}, label={self.label!r})\"\n\n"
     "    def __eq__(self, other):\n        if not isinstance(other, Point):\n"
     "            return NotImplemented\n"
     "        return (self.x, self.y, self.label) == (other.x, other.y, other.label)\n\n"
     "    def distance_to(self, other):\n"
     "        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5\n"),
    ("Repeat these meeting notes exactly.",
     "Meeting notes, 14 March. Present: Priya, Jonas, Elena, Mark. 1. The release is moved to "
     "2 April because the payment tests are still failing on the staging server. 2. Jonas will "
     "fix the flaky login test by Friday. 3. Elena asked for a second reviewer on database "
     "changes; everyone agreed. 4. Mark will present the new dashboard at the next meeting. "
     "5. The office will be closed on 29 March. Next meeting: 21 March at 10:00 in room B."),
    ("Fix the bug in this function (it should return the largest value) and repeat the rest unchanged.",
     "def largest(values):\n    \"\"\"Return the largest number in a non-empty list.\"\"\"\n"
     "    best = values[0]\n    for value in values[1:]:\n        if value < best:\n"
     "            best = value\n    return best\n\n\n"
     "def test_largest():\n    assert largest([3, 1, 4, 1, 5, 9, 2, 6]) == 9\n"
     "    assert largest([-7, -3, -10]) == -3\n    assert largest([42]) == 42\n"),
    ("Rewrite this paragraph in British English spelling; change nothing else.",
     "The city center was full of color during the festival. Every neighborhood organized its "
     "own parade, and the traveling musicians played in the theater district until midnight. "
     "The organizers had analyzed last year's program and realized that visitors favored "
     "shorter shows, so each performance was limited to thirty minutes. The mayor apologized "
     "for the traffic and promised a better catalog of events next year."),
    ("Repeat this HTML snippet exactly.",
     "<form action=\"/subscribe\" method=\"post\" class=\"newsletter\">\n"
     "  <label for=\"email\">Email address</label>\n"
     "  <input type=\"email\" id=\"email\" name=\"email\" required placeholder=\"you@example.com\">\n"
     "  <label for=\"topics\">Topics</label>\n  <select id=\"topics\" name=\"topics\" multiple>\n"
     "    <option value=\"news\">News</option>\n    <option value=\"events\">Events</option>\n"
     "    <option value=\"offers\">Offers</option>\n  </select>\n"
     "  <button type=\"submit\">Subscribe</button>\n</form>\n"),
    ("Shorten each sentence of this text slightly, keeping the same order and most of the words.",
     "The museum's new wing, which opened to the public last spring after four years of "
     "construction, houses a collection of more than two thousand maps. The oldest of these "
     "maps was drawn by hand in the early fifteenth century and shows the coast of Portugal in "
     "remarkable detail. Visitors can also use large touch screens to compare old maps with "
     "modern satellite images of the same places, which is especially popular with school "
     "groups."),
    ("Convert this Python loop into a list comprehension and repeat the rest of the code unchanged.",
     "import csv\n\n\ndef load_adults(path):\n    with open(path, newline=\"\") as f:\n"
     "        rows = list(csv.DictReader(f))\n    adults = []\n    for row in rows:\n"
     "        if int(row[\"age\"]) >= 18:\n            adults.append(row[\"name\"].strip().title())\n"
     "    return adults\n\n\nif __name__ == \"__main__\":\n"
     "    for name in load_adults(\"people.csv\"):\n        print(name)\n"),
    ("Repeat the following instructions exactly as written.",
     "To reset your router, first unplug it from the power socket and wait thirty seconds. "
     "Plug it back in and wait until the power light stops blinking, which takes about two "
     "minutes. If the internet light is still red, press the reset button on the back with a "
     "paper clip and hold it for ten seconds. The router will restart with its factory "
     "settings. Connect to the network printed on the label under the router, and open "
     "the setup page at 192.168.1.1 to choose a new password."),
    ("Sort the entries of this Python dictionary alphabetically by key and show the result.",
     "COUNTRY_CODES = {\n    \"Spain\": \"ES\",\n    \"Germany\": \"DE\",\n    \"Japan\": \"JP\",\n"
     "    \"Brazil\": \"BR\",\n    \"Canada\": \"CA\",\n    \"France\": \"FR\",\n    \"India\": \"IN\",\n"
     "    \"Australia\": \"AU\",\n    \"Mexico\": \"MX\",\n    \"Italy\": \"IT\",\n"
     "    \"Norway\": \"NO\",\n    \"Egypt\": \"EG\",\n}\n"),
]

CHAT_PROMPTS: list[str] = [
    "What are some good ways to stay focused when working from home?",
    "Why is the sky blue during the day and red at sunset?",
    "Can you suggest a simple vegetarian dinner I could cook in twenty minutes?",
    "What is the difference between a virus and a bacterium?",
    "How should I prepare for my first job interview?",
    "Explain in simple terms how a credit card works.",
    "What are the main causes of inflation?",
    "Write a short story about a robot who learns to paint.",
    "How do I start learning to play the guitar as an adult?",
    "What should I consider when choosing a laptop for university?",
    "Why do cats purr?",
    "What are the pros and cons of living in a big city?",
    "How does a refrigerator keep food cold?",
    "Give me some tips for taking better photos with my phone.",
    "What is machine learning, and how is it different from ordinary programming?",
    "How can I improve my sleep?",
    "What happened during the French Revolution?",
    "Describe a perfect weekend trip to the mountains.",
    "How do vaccines train the immune system?",
    "What are some good habits for managing personal finances?",
    "Why do leaves change colour in autumn?",
    "What makes a good team leader?",
    "How do airplanes stay in the air?",
    "Can you explain what a black hole is?",
    "What are some fun activities to do with children on a rainy day?",
    "How do I write a good cover letter?",
]

COPY_PROMPTS: list[str] = [f"{instruction}\n\n{passage}" for instruction, passage in _COPY]

PROMPT_SETS: dict[str, list[str]] = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """The chat messages of one benchmark prompt (render them with the engine's template)."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


def sharegpt(prompts: list[str]) -> list[dict]:
    """``prompts`` as a ShareGPT-format dataset (a human turn each, an empty model turn), the
    file shape third-party benchmark clients read (``--dataset-name sharegpt --dataset-path``)."""
    return [{"id": f"specserve-{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": ""}]}
            for i, p in enumerate(prompts)]
