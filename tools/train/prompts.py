"""Training-instruction generator for the SmolLM2-135M MTP head (self-distillation data).

Every prompt is produced here from templates x topics (all text written for this project).
It does not read the benchmark prompts (bench/prompts.jsonl) or anything derived from them.

`build_conversations(seed)` returns a deterministic list of conversations:
    {"id": str, "kind": str, "turns": [user_text, ...]}
Single-turn conversations have one user turn. Multi-turn conversations have two: the second is
asked after the target's own greedy answer to the first (filled in by train_mtp.py).
`split_ids(convs, frac)` gives a deterministic held-out split by conversation id (hash based).
"""

import hashlib
import random

# ---------------------------------------------------------------------------------------------
# Topic pools
# ---------------------------------------------------------------------------------------------

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the French Revolution",
    "machine learning", "vaccines", "inflation", "compound interest", "the internet", "blockchain",
    "climate change", "plate tectonics", "the immune system", "DNA", "gravity", "electricity",
    "magnets", "rainbows", "the phases of the moon", "earthquakes", "the Roman Empire",
    "the printing press", "democracy", "supply and demand", "recycling", "coffee", "honeybees",
    "sleep", "meditation", "regular exercise", "a balanced diet", "time management",
    "public speaking", "learning a new language", "vegetable gardening", "chess", "jazz music",
    "photography", "the Olympic Games", "renewable energy", "solar panels", "electric cars",
    "how airplanes fly", "submarines", "the human heart", "the human brain", "antibiotics",
    "viruses", "bacteria", "ocean tides", "hurricanes", "deserts", "rainforests", "glaciers",
    "dinosaurs", "evolution", "the periodic table", "atoms", "chemical reactions", "friction",
    "sound waves", "light and color", "telescopes", "Mars", "the solar system", "stars",
    "galaxies", "quantum computing", "encryption", "password security", "databases",
    "operating systems", "compilers", "version control with Git", "cloud computing",
    "social media", "personal budgeting", "saving money", "job interviews", "remote work",
    "teamwork", "essay writing", "critical thinking", "the scientific method", "statistics",
    "probability", "prime numbers", "fractions", "geometry", "the Pythagorean theorem",
    "the Industrial Revolution", "ancient Egypt", "the Renaissance", "the Silk Road",
    "world trade", "cryptocurrency", "artificial intelligence", "robots", "3D printing",
    "nuclear power", "wind turbines", "batteries", "semiconductors", "the stock market",
    "mindfulness", "healthy habits", "stress", "friendship", "volunteering", "urban planning",
    "public transportation", "bicycles", "the history of writing", "libraries", "museums",
    "the human skeleton", "muscles", "digestion", "the lungs", "blood types", "allergies",
    "first aid", "fire safety", "weather forecasting", "clouds", "lightning", "snowflakes",
    "coral reefs", "whales", "octopuses", "ants", "migratory birds", "wolves", "trees",
    "mushrooms", "soil", "composting", "bread baking", "fermentation", "chocolate", "tea",
    "the Moon landing", "satellites", "GPS", "smartphones", "the web browser", "email",
    "open source software", "unit testing", "recursion", "sorting algorithms", "hash tables",
    "binary numbers", "logic gates", "the CPU", "memory and caching", "networking protocols",
]

SHORT_TOPICS = [
    "the ocean", "autumn leaves", "a rainy day", "the city at night", "a cup of tea", "the stars",
    "an old bicycle", "winter mornings", "a quiet library", "the first day of school", "friendship",
    "the mountains", "a busy kitchen", "a summer storm", "an empty train station", "the desert",
    "a garden in spring", "the moon", "a lost key", "the sound of the sea", "a candle", "snow",
    "a lighthouse", "a cat sleeping in the sun", "the wind", "a river", "coffee in the morning",
    "a forgotten letter", "the last day of summer", "a starry sky", "a market in the morning",
]

CHARACTERS = [
    "a curious robot", "a lonely lighthouse keeper", "a young dragon", "a retired astronaut",
    "a talking cat", "a brave little mouse", "a time traveler", "a village baker", "a detective",
    "a lost puppy", "a wizard's apprentice", "an old fisherman", "a shy student", "a pirate captain",
    "a gardener", "a clumsy knight", "a grandmother who loves puzzles", "a street musician",
    "a girl who can talk to birds", "an inventor", "a tired mail carrier", "a friendly ghost",
    "a young scientist", "a penguin", "a chef", "a mountain climber", "a librarian", "a fox",
    "twin sisters", "a boy and his grandfather", "a small cloud", "an alien tourist",
]

EVENTS = [
    "finds a mysterious map", "learns to fly", "loses their memory", "discovers a hidden door",
    "makes an unlikely friend", "enters a baking contest", "gets lost in a storm",
    "finds a message in a bottle", "has to save the village", "wakes up in a different century",
    "tries to win a race", "discovers a secret talent", "opens a small shop",
    "finds a magic stone", "goes on a long journey", "solves a strange mystery",
    "plants a magical seed", "meets a giant", "builds a flying machine", "forgets their birthday",
]

SETTINGS = [
    "a snowy village", "a space station", "an underwater city", "a busy market",
    "an enchanted forest", "a desert town", "a floating island", "an old castle", "a small farm",
    "a crowded train", "a lighthouse", "a city of the future", "a jungle", "a school", "the moon",
]

STORY_TEMPLATES = [
    "Write a short story about {char} who {event}.",
    "Write a very short story (under 200 words) about {char} who {event}.",
    "Tell me a bedtime story about {char}.",
    "Write a funny story about {char} in {setting}.",
    "Write a fairy tale about {char} who {event}.",
    "Write the opening paragraph of a mystery story set in {setting}.",
    "Write a dialogue between {char} and {char2}.",
    "Write a story for children about {char} who lives in {setting}.",
    "Write a short adventure story that takes place in {setting}.",
    "Describe {setting} as if you were {char}.",
]

POEM_TEMPLATES = [
    "Write a poem about {thing}.", "Write a haiku about {thing}.", "Write a limerick about {thing}.",
    "Write a short rhyming poem about {thing}.", "Write four lines of poetry about {thing}.",
    "Write a song chorus about {thing}.",
]

QUESTION_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "How does {t} work?", "Why is {t} important?",
    "Give me a short overview of {t}.", "Explain {t} to a ten-year-old.",
    "What are the main facts I should know about {t}?", "Write a paragraph about {t}.",
    "What are common misconceptions about {t}?", "Describe the history of {t} briefly.",
    "What are the pros and cons of {t}?", "Summarize the key ideas of {t} in three sentences.",
    "Can you explain {t} step by step?", "Tell me something interesting about {t}.",
    "I am a beginner. Where should I start if I want to learn about {t}?",
    "Write a short explanation of {t} for a school report.", "What is the role of {t} in everyday life?",
]

LIST_TEMPLATES = [
    "List {n} interesting facts about {t}.", "Give me {n} tips related to {t}.",
    "What are {n} questions a student might ask about {t}?", "List {n} key terms related to {t} and define each.",
    "Give me {n} reasons why people should learn about {t}.", "Make a checklist of {n} things to know about {t}.",
]

COMPARE_TEMPLATES = [
    "Compare {a} and {b}.", "What is the difference between {a} and {b}?",
    "Which is more interesting, {a} or {b}? Explain your answer.", "How are {a} and {b} similar?",
]

# ---------------------------------------------------------------------------------------------
# Code writing
# ---------------------------------------------------------------------------------------------

LANGS = ["Python", "JavaScript", "TypeScript", "Rust", "Go", "C", "C++", "Java", "C#", "Ruby",
         "Kotlin", "Swift", "PHP", "Haskell", "Lua"]

CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "finds the maximum element in a list",
    "counts the vowels in a string", "checks whether a string is a palindrome",
    "implements binary search on a sorted array", "sorts a list using bubble sort",
    "merges two sorted lists into one sorted list", "removes duplicates from a list",
    "reads a text file and counts its lines", "converts Celsius to Fahrenheit", "implements a stack",
    "implements a queue", "computes the greatest common divisor of two numbers",
    "splits a CSV line into fields", "checks whether an email address looks valid",
    "flattens a nested list", "counts how often each word appears in a text", "prints FizzBuzz from 1 to 100",
    "transposes a matrix", "computes the average of a list of numbers",
    "finds the second largest number in a list", "implements a singly linked list",
    "checks whether the parentheses in a string are balanced", "converts a decimal number to binary",
    "capitalizes the first letter of each word", "checks whether two words are anagrams",
    "computes the sum of the digits of a number", "rotates an array by k positions",
    "implements quicksort", "computes the dot product of two vectors",
    "checks whether a year is a leap year", "implements a simple LRU cache",
    "finds the longest common prefix of a list of strings", "counts the set bits in an integer",
    "generates all prime numbers up to n with the sieve of Eratosthenes",
    "returns the n-th row of Pascal's triangle", "converts a Roman numeral to an integer",
    "finds the index of the first non-repeating character in a string", "computes the power of a number using fast exponentiation",
    "parses a date string in the format YYYY-MM-DD", "shuffles a list randomly",
]

SQL_TASKS = [
    "selects all customers from the city of Paris", "counts the orders per customer",
    "finds the five most expensive products", "computes the average salary per department",
    "lists employees hired after 2020", "joins the orders table with the customers table",
    "deletes rows with a NULL email", "finds customers who never placed an order",
    "updates the price of a product by 10 percent", "creates a table for blog posts",
    "finds duplicate email addresses in a users table", "returns the total sales per month",
]

BASH_TASKS = [
    "counts the files in a directory", "renames all .txt files to .md", "prints the 10 largest files in a folder",
    "backs up a directory into a tar.gz archive with today's date", "checks whether a website is reachable",
    "finds all lines containing the word ERROR in a log file", "loops over numbers 1 to 10 and prints them",
    "prints the disk usage of each subdirectory", "deletes files older than 30 days",
    "reads a file line by line and prints line numbers",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "How do I write a {lang} program that {task}?",
    "Show me {lang} code that {task}, with comments.", "Implement a function in {lang} that {task} and explain how it works.",
    "Write {lang} code that {task}. Keep it short.", "Can you give me an example in {lang} of a function that {task}?",
]

CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?", "What does the `static` keyword mean in Java?",
    "Explain ownership and borrowing in Rust.", "What is a closure in JavaScript?", "What are goroutines in Go?",
    "What is the difference between `==` and `===` in JavaScript?", "What is a pointer in C?",
    "Explain what a REST API is.", "What is the difference between a process and a thread?",
    "What does `git rebase` do?", "What is a race condition?", "What is Big O notation?",
    "Explain the difference between SQL and NoSQL databases.", "What is a virtual environment in Python?",
    "What is dependency injection?", "What is the difference between an interface and an abstract class?",
    "What is recursion? Give an example.", "What is a memory leak and how can I avoid one?",
    "What are Python decorators?", "Explain async and await in JavaScript.", "What is a hash function?",
    "What is the difference between TCP and UDP?", "What does a compiler do?", "What is a Docker container?",
    "What is the difference between `let`, `const` and `var` in JavaScript?", "What are generics in Rust?",
    "How does garbage collection work?", "What is a unit test?", "What is a linked list?",
    "When should I use a dictionary instead of a list in Python?",
]

# Code snippets for editing / refactoring prompts (written for this project).
SNIPPETS = [
    ("python", """def f(l):
    r = []
    for i in range(len(l)):
        if l[i] % 2 == 0:
            r.append(l[i] * l[i])
    return r"""),
    ("python", """def avg(nums):
    total = 0
    for n in nums:
        total += n
    return total / len(nums)"""),
    ("python", """def find(d, k):
    for key in d.keys():
        if key == k:
            return d[key]
    return None"""),
    ("python", """def count_words(text):
    counts = {}
    for w in text.split():
        if w in counts:
            counts[w] = counts[w] + 1
        else:
            counts[w] = 1
    return counts"""),
    ("python", """def is_prime(n):
    for i in range(2, n):
        if n % i == 0:
            return False
    return True"""),
    ("python", """class Account:
    def __init__(self, b):
        self.b = b
    def w(self, x):
        self.b = self.b - x
        return self.b
    def d(self, x):
        self.b = self.b + x
        return self.b"""),
    ("python", """def read_numbers(path):
    f = open(path)
    data = f.read()
    nums = []
    for line in data.split("\\n"):
        nums.append(int(line))
    return nums"""),
    ("javascript", """function sum(arr) {
  var s = 0;
  for (var i = 0; i <= arr.length; i++) {
    s = s + arr[i];
  }
  return s;
}"""),
    ("javascript", """function getNames(users) {
  let names = [];
  for (let i = 0; i < users.length; i++) {
    if (users[i].active == true) {
      names.push(users[i].name);
    }
  }
  return names;
}"""),
    ("javascript", """function fetchData(url, cb) {
  fetch(url).then(function (res) {
    res.json().then(function (data) {
      cb(data);
    });
  });
}"""),
    ("rust", """fn largest(v: &Vec<i32>) -> i32 {
    let mut m = v[0];
    for i in 0..v.len() {
        if v[i] > m {
            m = v[i];
        }
    }
    m
}"""),
    ("rust", """fn parse(s: &str) -> i32 {
    let n: i32 = s.trim().parse().unwrap();
    n * 2
}"""),
    ("go", """func Contains(xs []string, x string) bool {
	for i := 0; i < len(xs); i++ {
		if xs[i] == x {
			return true
		}
	}
	return false
}"""),
    ("c", """int sum(int *a, int n) {
    int s;
    for (int i = 0; i < n; i++)
        s += a[i];
    return s;
}"""),
    ("c", """char *copy(const char *s) {
    char *r = malloc(strlen(s));
    strcpy(r, s);
    return r;
}"""),
    ("java", """public int countA(String s) {
    int c = 0;
    for (int i = 0; i < s.length(); i++) {
        if (s.charAt(i) == 'a' || s.charAt(i) == 'A') {
            c = c + 1;
        }
    }
    return c;
}"""),
    ("java", """public static String join(List<String> items) {
    String out = "";
    for (String item : items) {
        out = out + item + ",";
    }
    return out;
}"""),
    ("cpp", """int maxOf(std::vector<int> v) {
    int best = -1;
    for (int i = 0; i < v.size(); i++)
        if (v[i] > best) best = v[i];
    return best;
}"""),
    ("ruby", """def squares(n)
  result = []
  i = 1
  while i <= n
    result << i * i
    i += 1
  end
  result
end"""),
    ("sql", """SELECT * FROM orders, customers WHERE orders.customer_id = customers.id AND customers.country = 'France' ORDER BY orders.date"""),
    ("bash", """for f in $(ls *.log); do
  cat $f | grep error | wc -l
done"""),
    ("typescript", """function area(shape: any): number {
  if (shape.kind == "circle") return 3.14 * shape.r * shape.r;
  if (shape.kind == "square") return shape.s * shape.s;
  return 0;
}"""),
]

LANG_NAMES = {"python": "Python", "javascript": "JavaScript", "rust": "Rust", "go": "Go", "c": "C",
              "java": "Java", "cpp": "C++", "ruby": "Ruby", "sql": "SQL", "bash": "Bash",
              "typescript": "TypeScript"}

EDIT_INSTRUCTIONS = [
    "Refactor this code to make it more readable:", "Add comments to this code:",
    "Find and fix the bug in this code:", "Explain what this code does:", "Optimize this code:",
    "Rename the variables in this code so they are more descriptive:",
    "Write unit tests for this code:", "Add error handling to this code:",
    "Review this code and suggest improvements:", "Rewrite this code in {other}:",
    "Simplify this code:", "Is there anything wrong with this code?",
]

# Programmatic snippet family: small Python functions with varied names and operations.
_OPS = [("sum", "total += x", "total = 0"), ("product", "total *= x", "total = 1"),
        ("count of positive numbers", "total += 1 if x > 0 else 0", "total = 0"),
        ("sum of squares", "total += x * x", "total = 0"), ("maximum", "total = x if x > total else total", "total = float('-inf')")]
_NAMES = ["calc", "process", "do_it", "helper", "compute", "run", "go", "work", "thing", "func"]
_VARS = ["data", "items", "values", "xs", "arr", "lst", "numbers", "stuff"]


def _generated_snippets(rng):
    out = []
    for desc, body, init in _OPS:
        for _ in range(3):
            name, var = rng.choice(_NAMES), rng.choice(_VARS)
            code = f"def {name}({var}):\n    {init}\n    for x in {var}:\n        {body}\n    return total"
            out.append(("python", code))
    return out

# ---------------------------------------------------------------------------------------------
# Paragraphs for summarising / rewriting (written for this project)
# ---------------------------------------------------------------------------------------------

PARAGRAPHS = [
    "The town council met on Tuesday evening to discuss the new bicycle lanes on Main Street. Several shop owners worried that removing parking spaces would hurt their business, while cyclists argued that safer lanes would bring more customers on foot and by bike. After two hours of debate, the council agreed to run a six-month trial and to collect data on traffic and sales before making a final decision.",
    "Honeybees communicate with each other through a behaviour known as the waggle dance. When a forager finds a good source of nectar, it returns to the hive and moves in a figure-eight pattern. The angle of the dance tells the other bees the direction of the flowers relative to the sun, and the length of the waggle tells them how far away the flowers are.",
    "our team have finished the first version of the app last week, but their is still many bugs. The login screen crash sometimes when the user type a long password and the settings page dont save the changes. We plans to fix these problem before the release next month.",
    "Regular sleep is one of the most important habits for good health. Adults who sleep seven to nine hours a night tend to have better memory, a stronger immune system and a more stable mood. Keeping a regular schedule, avoiding screens before bed and keeping the bedroom dark and cool can all help people fall asleep more easily.",
    "The first commercial steam railway opened in 1825 in the north of England. Before then, goods were moved by horse-drawn wagons or by boats on canals, which was slow and expensive. Railways made it possible to carry coal, cotton and passengers quickly over long distances, and within a few decades they had spread across Europe and North America.",
    "Thank you for your order. Unfortunately, the blue jacket you selected is out of stock in size medium. We expect new stock to arrive within two weeks. You can choose to wait, pick a different size or colour, or cancel the order for a full refund. Please reply to this email to let us know what you would prefer.",
    "Coral reefs cover less than one percent of the ocean floor, yet they are home to about a quarter of all marine species. Reefs protect coastlines from waves and storms and provide food and income for millions of people. Rising sea temperatures cause corals to expel the algae living in their tissues, a process called bleaching, which can kill large parts of a reef.",
    "The meeting started late because the projector did not work. Anna presented the sales figures for the third quarter, which were eight percent higher than last year. Ben raised a concern about delivery delays in the northern region. The team decided that Carla will contact the logistics company and report back at the next meeting on Friday.",
    "Learning to play a musical instrument takes patience. Beginners often feel frustrated because progress seems slow at first. Practising a little every day is usually more effective than practising for many hours once a week. Setting small goals, such as learning one new song each month, can help keep motivation high.",
    "Compilers translate source code written by programmers into machine code that a computer can run. A typical compiler works in several stages: it first breaks the text into tokens, then builds a tree that represents the structure of the program, checks the program for errors, optimises it and finally produces the machine instructions.",
    "The new phone has a larger screen, a faster processor and a battery that lasts up to two days. The camera has been improved for low-light photos, and the device is now water resistant. However, it is heavier than the previous model and the price has increased by about one hundred dollars.",
    "Volunteering can benefit both the community and the volunteer. People who volunteer often report feeling happier and more connected to others. It is also a good way to learn new skills, meet people and gain experience that can help when applying for jobs.",
    "Yesterday I went to the market early in the morning. I bought fresh bread, a bag of apples and some cheese from a farmer who told me about his goats. On the way home it started to rain, so I waited under a bridge and watched the river for a while before walking back.",
    "Remote work has become common for many office jobs. Employees save time on commuting and can often organise their day more flexibly. On the other hand, some people feel isolated, and it can be harder to separate work from private life. Many companies now use a hybrid model with a few office days each week.",
    "The library will be closed from the 3rd to the 10th of August for renovation. During this time, books can be returned using the drop box next to the main entrance. Online services, including e-books and the catalogue, will remain available. We apologise for any inconvenience.",
    "Photosynthesis is the process plants use to turn light into chemical energy. Inside the leaves, chlorophyll absorbs sunlight, and the plant uses this energy to combine carbon dioxide from the air with water from the soil. The result is glucose, which the plant uses for growth, and oxygen, which is released into the air.",
    "A good password should be long and hard to guess. Using a phrase made of several random words is often easier to remember than a short string of symbols. It is also important not to reuse the same password on different websites, because a leak on one site could then give attackers access to other accounts.",
    "The hiking trail starts at the car park near the old mill and climbs steadily through pine forest for about three kilometres. After a short steep section, it reaches a viewpoint with a view over the lake. The full loop takes around three hours, and walkers are advised to bring water and good shoes, as the path can be muddy after rain.",
    "In the story, a young girl finds an injured bird in her garden. She takes care of it for several weeks, feeding it and keeping it warm, even though her brother says it will never fly again. One morning the bird flies out of the open window, and the girl realises that helping it meant letting it go.",
    "Inflation means that prices rise over time, so the same amount of money buys fewer goods. Moderate inflation is normal in a growing economy, but high inflation can make it difficult for families to plan and can reduce the value of savings. Central banks often raise interest rates to slow inflation down.",
]

PARA_INSTRUCTIONS = [
    "Summarize the following paragraph in one sentence:", "Rewrite this paragraph in a formal tone:",
    "Rewrite this text so that a child can understand it:", "Turn this paragraph into a bulleted list of key points:",
    "Give this paragraph a short title:", "Fix any grammar mistakes in this text:", "Make this text shorter:",
    "What is the main idea of this paragraph?", "Rewrite this paragraph in a friendly, casual tone:",
    "Write three questions about this text:", "Summarize this text in two sentences:",
    "Extract the most important facts from this text:", "Paraphrase the following text:",
]

# Programmatic pasted texts: meeting notes / short emails with varied details.
_PEOPLE = ["Alice", "Bob", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Lena"]
_THINGS = ["the website redesign", "the budget for next year", "the summer party", "the new hiring plan",
           "the customer survey", "the office move", "the product launch", "the training program"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def _generated_texts(rng, n):
    out = []
    for _ in range(n):
        a, b, c = rng.sample(_PEOPLE, 3)
        thing, day = rng.choice(_THINGS), rng.choice(_DAYS)
        pct = rng.randint(3, 40)
        kind = rng.randint(0, 2)
        if kind == 0:
            t = (f"Notes from today's meeting: {a} gave an update on {thing}. The work is about {pct} percent done. "
                 f"{b} said the team needs more time for testing. {c} will prepare a summary for the managers, "
                 f"and the next meeting is on {day}.")
        elif kind == 1:
            t = (f"Hi {a}, I wanted to let you know that {thing} has been delayed until {day}. {b} is waiting for "
                 f"feedback from the other team, and the cost estimate went up by {pct} percent. Could you please "
                 f"check the plan with {c}? Thanks!")
        else:
            t = (f"Report: {thing} received mixed feedback. About {pct} percent of the people asked were unhappy with "
                 f"the schedule. {a} suggested moving the deadline, while {b} preferred adding more staff. "
                 f"A decision is expected from {c} on {day}.")
        out.append(t)
    return out

# ---------------------------------------------------------------------------------------------
# Misc practical prompts
# ---------------------------------------------------------------------------------------------

EMAIL_RECIPIENTS = ["my manager", "a customer", "my landlord", "a teacher", "a colleague", "a new client", "my neighbour", "the school principal"]
EMAIL_SUBJECTS = ["asking for a day off", "a delayed delivery", "a broken heater", "a missed deadline", "a meeting next week",
                  "thanking them for their help", "a price increase", "a noise complaint", "a project update", "rescheduling an appointment"]
DISHES = ["pancakes", "tomato soup", "a vegetable curry", "banana bread", "a simple salad", "fried rice", "lemonade", "guacamole",
          "spaghetti with tomato sauce", "chocolate chip cookies", "an omelette", "hummus"]
GOALS = ["sleep better", "learn to code", "save money for a trip", "stay focused while studying", "get more exercise",
         "make new friends in a new city", "reduce stress at work", "read more books", "eat healthier", "prepare for an exam",
         "improve my handwriting", "become more organised", "start running", "learn to cook"]
WORDS = ["serendipity", "resilient", "ephemeral", "meticulous", "ubiquitous", "candid", "diligent", "eloquent", "pragmatic",
         "ambiguous", "benevolent", "curious", "frugal", "tenacious", "vivid"]
SENTENCES = ["Where is the train station?", "I would like a cup of coffee, please.", "The weather is beautiful today.",
             "How much does this cost?", "My brother is learning to play the guitar.", "We are going to the beach tomorrow."]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]
BUSINESSES = ["bakery", "coffee shop", "bookstore", "bike repair shop", "pet grooming business", "software startup", "flower shop", "gym"]
REVIEWS = ["The food was cold and the waiter ignored us for twenty minutes.", "Absolutely loved this book, I could not put it down!",
           "The hotel room was clean but very small.", "Great value for the price, would buy again.",
           "The app keeps crashing every time I open it.", "Friendly staff and a lovely view from the terrace."]


def _misc_prompts(rng):
    out = []
    for r in EMAIL_RECIPIENTS:
        for s in EMAIL_SUBJECTS:
            out.append(("email", f"Write a short email to {r} about {s}."))
    for d in DISHES:
        out.append(("recipe", rng.choice(["Give me a simple recipe for {d}.", "How do I make {d}?", "What ingredients do I need for {d}?"]).format(d=d)))
    for g in GOALS:
        for tpl in ["How can I {g}?", "Give me a plan to {g}.", "What are some tips to {g}?"]:
            out.append(("advice", tpl.format(g=g)))
    for w in WORDS:
        out.append(("define", f"Define the word '{w}' and use it in a sentence."))
        out.append(("define", f"What does '{w}' mean? Give two examples."))
    for s in SENTENCES:
        for L in TARGET_LANGS:
            out.append(("translate", f"Translate '{s}' into {L}."))
    for bz in BUSINESSES:
        out.append(("brainstorm", f"Suggest five names for a {bz}."))
        out.append(("brainstorm", f"Write a short slogan for a {bz}."))
        out.append(("brainstorm", f"Write a short product description for a new {bz} in town."))
    for rv in REVIEWS:
        out.append(("classify", f"Is the following review positive or negative? Explain briefly.\n\n\"{rv}\""))
    for _ in range(120):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        k = rng.randint(0, 5)
        if k == 0:
            out.append(("math", f"What is {a} + {b}?"))
        elif k == 1:
            out.append(("math", f"What is {a} times {rng.randint(2, 20)}?"))
        elif k == 2:
            out.append(("math", f"Solve for x: {rng.randint(2, 9)}x + {a} = {a + b}"))
        elif k == 3:
            out.append(("math", f"What is {rng.choice([5, 10, 15, 20, 25, 50])}% of {a}?"))
        elif k == 4:
            out.append(("math", f"A shop sells apples for {rng.randint(1, 9)} dollars per kilogram. How much do {rng.randint(2, 12)} kilograms cost?"))
        else:
            out.append(("math", f"A train travels {a} kilometres in {rng.randint(2, 9)} hours. What is its average speed?"))
    return out

# ---------------------------------------------------------------------------------------------
# Multi-turn follow-ups (second user turn after the target's own first answer)
# ---------------------------------------------------------------------------------------------

FOLLOWUPS_GENERAL = [
    "Can you make that shorter?", "Can you give me an example?", "Explain that again more simply.",
    "Thanks! Can you summarize it in one sentence?", "What else should I know about this?",
    "Now write it as a bulleted list.", "Can you explain the most important part in more detail?",
    "Why is that?", "Can you write that for a ten-year-old?", "Give me three questions to test my understanding.",
]
FOLLOWUPS_CODE = [
    "Can you add comments to that code?", "How would I test this?", "Can you make it handle empty input?",
    "What is the time complexity of this?", "Now write the same thing in {other}.", "Can you explain the code line by line?",
    "Can you make it shorter?", "What happens if the input is very large?",
]
FOLLOWUPS_STORY = [
    "Can you continue the story?", "Give the story a title.", "Rewrite it with a happy ending.",
    "Make it funnier.", "Tell the same story from another character's point of view.",
]


def _h(s):
    return hashlib.sha256(s.encode()).hexdigest()


def build_conversations(seed=1234, max_single=6000, max_multi=600):
    rng = random.Random(seed)
    single = []  # (kind, text)
    for t in TOPICS:
        for tpl in rng.sample(QUESTION_TEMPLATES, 9):
            single.append(("question", tpl.format(t=t)))
        for tpl in LIST_TEMPLATES:
            single.append(("list", tpl.format(t=t, n=rng.choice([3, 4, 5, 6, 7, 10]))))
    for _ in range(300):
        a, b = rng.sample(TOPICS, 2)
        single.append(("compare", rng.choice(COMPARE_TEMPLATES).format(a=a, b=b)))
    for _ in range(700):
        c1, c2 = rng.sample(CHARACTERS, 2)
        single.append(("story", rng.choice(STORY_TEMPLATES).format(char=c1, char2=c2, event=rng.choice(EVENTS), setting=rng.choice(SETTINGS))))
    for th in SHORT_TOPICS + TOPICS[:40]:
        for tpl in rng.sample(POEM_TEMPLATES, 3):
            single.append(("poem", tpl.format(thing=th)))
    for lang in LANGS:
        for task in CODE_TASKS:
            for tpl in rng.sample(CODE_TEMPLATES, 2):
                single.append(("code", tpl.format(lang=lang, task=task)))
    for task in SQL_TASKS:
        for tpl in ["Write an SQL query that {task}.", "How do I write a SQL query that {task}?"]:
            single.append(("code", tpl.format(task=task)))
    for task in BASH_TASKS:
        for tpl in ["Write a Bash script that {task}.", "How can I write a shell command that {task}?"]:
            single.append(("code", tpl.format(task=task)))
    for q in CODE_QUESTIONS:
        single.append(("code_question", q))
    snippets = SNIPPETS + _generated_snippets(rng)
    for lang, code in snippets:
        for instr in EDIT_INSTRUCTIONS:
            other = rng.choice([L for L in LANGS if L.lower() != LANG_NAMES[lang].lower()])
            single.append(("code_edit", instr.format(other=other) + f"\n\n```{lang}\n{code}\n```"))
    texts = PARAGRAPHS + _generated_texts(rng, 60)
    for text in texts:
        for instr in rng.sample(PARA_INSTRUCTIONS, 7):
            single.append(("rewrite", f"{instr}\n\n{text}"))
    single += _misc_prompts(rng)

    # dedupe (stable), shuffle deterministically, cap
    seen, uniq = set(), []
    for k, t in single:
        if t not in seen:
            seen.add(t)
            uniq.append((k, t))
    rng.shuffle(uniq)
    uniq = uniq[:max_single]

    multi = []
    first_pool = [(k, t) for k, t in uniq if k in ("question", "code", "story", "list", "code_question")]
    for k, t in rng.sample(first_pool, min(max_multi, len(first_pool))):
        if k == "code":
            f = rng.choice(FOLLOWUPS_CODE).format(other=rng.choice(LANGS))
        elif k == "story":
            f = rng.choice(FOLLOWUPS_STORY)
        else:
            f = rng.choice(FOLLOWUPS_GENERAL)
        multi.append(("multi_" + k, [t, f]))

    # split_key: a multi-turn conversation is held out iff its first turn (also a single prompt) is.
    convs = [{"id": "s" + _h(t)[:12], "kind": k, "turns": [t], "split_key": "s" + _h(t)[:12]} for k, t in uniq]
    convs += [{"id": "m" + _h(t[0] + "\x00" + t[1])[:12], "kind": k, "turns": t, "split_key": "s" + _h(t[0])[:12]}
              for k, t in multi]
    return convs


def is_heldout(conv, frac=0.05):
    """Deterministic held-out split by hash of the conversation's split_key (prompts, not tokens)."""
    return int(_h("heldout:" + conv["split_key"])[:8], 16) / 0xFFFFFFFF < frac


if __name__ == "__main__":
    import collections
    import sys
    convs = build_conversations()
    print(len(convs), "conversations;", sum(is_heldout(c) for c in convs), "held out")
    print(collections.Counter(c["kind"] for c in convs))
    rng = random.Random(0)
    for c in rng.sample(convs, int(sys.argv[1]) if len(sys.argv) > 1 else 8):
        print("----", c["kind"], c["id"])
        for t in c["turns"]:
            print(">>", t)
